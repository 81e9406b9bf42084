"""Real models the suite trains, built tiny in code (random init, nothing downloaded):
transformers' causal LMs and torchvision's ResNet-18. Each is a loss of some inputs,
the inputs of step i, and a count of its blocks' forwards (a checkpointed model's
recomputations during backward included), trained eagerly, under stock CA and under
the plugin: around ``loss.backward()`` (``loops.train``) or, on Dynamo's config
path, inside a ``torch.compile``d step whose forward Dynamo compiles too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters

import ca_dynsaved
from helpers import Counts, counts
from loops import BACKEND, assert_steps_equal, train
from torchvision_shim import import_torchvision

#: How a transformers model checkpoints its layers (``gradient_checkpointing_enable``).
CHECKPOINTING = ("none", "non-reentrant", "reentrant")
VOCAB = 64


@dataclass
class RealModel:
    model: torch.nn.Module
    loss: Callable[..., torch.Tensor]  # the loss of a step's inputs
    inputs: Callable[[int], tuple[Any, ...]]  # the inputs of step i
    blocks: list[torch.nn.Module]  # whose forwards ``forwards`` counts (forward pre-hooks)
    forwards: list[int] = field(default_factory=lambda: [0])

    def __post_init__(self) -> None:
        for block in self.blocks:
            block.register_forward_pre_hook(lambda *_: self.forwards.__setitem__(0, self.forwards[0] + 1))

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def step(self, i: int) -> torch.Tensor:
        return self.loss(*self.inputs(i))

    def run(self, mode: str, steps: int) -> tuple[Counts, list[list[torch.Tensor | None]], int]:
        """``steps`` steps under ``mode`` from a fresh compile state: the counts, each
        step's gradients and the blocks' forwards. ``mode``: ``loops.MODES``, or
        ``config`` / ``config_stock``: each step ``torch.compile``d (forward and
        ``backward()``), on Dynamo's config path with the plugin's flag on / off."""
        self.forwards[0] = 0
        if mode.startswith("config"):
            found, grads = self._compiled_steps(mode == "config", steps)
        else:
            found, grads = train(self.step, self.params, mode, steps)
        return found, grads, self.forwards[0]

    def _compiled_steps(self, plugin: bool, steps: int) -> tuple[Counts, list[list[torch.Tensor | None]]]:
        ca_dynsaved.reset()
        counters.clear()

        def forward_backward(*inputs: Any) -> torch.Tensor:
            loss = self.loss(*inputs)
            loss.backward()
            return loss.detach()

        grads = []
        with torch._dynamo.config.patch(compiled_autograd=True, **{ca_dynsaved.CONFIG_FLAG: plugin}):
            step_fn = torch.compile(forward_backward, backend=BACKEND)
            for i in range(steps):
                for p in self.params:
                    p.grad = None
                step_fn(*self.inputs(i))
                grads.append([None if p.grad is None else p.grad.clone() for p in self.params])
        return counts(), grads


def compare_modes(model: RealModel, steps: int, modes: tuple[str, ...] = ("stock", "plugin")) -> dict[str, Any]:
    """Counts under each of ``modes`` over ``steps`` steps, each step's gradients
    asserted equal to eager's and the blocks' forwards as many as eager's; with
    ``"eager forwards"``, eager's count."""
    _, want, eager_forwards = model.run("eager", steps)
    found: dict[str, Any] = {"eager forwards": eager_forwards}
    for mode in modes:
        found[mode], got, forwards = model.run(mode, steps)
        assert_steps_equal(got, want)
        assert forwards == eager_forwards, (mode, forwards, eager_forwards)
    return found


def causal_lm(arch: str, checkpointing: str = "none", layers: int = 1) -> RealModel:
    """A tiny ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (dropout off, so eager and
    compiled steps see the same numbers), ``layers`` decoder layers; step i feeds a
    batch of 2 sequences of length 8 + i % 3 (new at each of the first three steps)."""
    import_torchvision()  # transformers imports it where installed: the shim first
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        )
        model = transformers.LlamaForCausalLM(config)
        decoder_layers = model.model.layers
    else:
        assert arch == "gpt2", arch
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=2, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(config)
        decoder_layers = model.transformer.h
    if checkpointing != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    model.config.use_cache = False  # what gradient checkpointing sets anyway (with a warning)
    model.train()

    def inputs(i: int) -> tuple[torch.Tensor]:
        return (torch.randint(0, VOCAB, (2, 8 + i % 3), generator=torch.Generator().manual_seed(i)),)

    # Each layer's MLP: inside the checkpointed region, so its forward runs again in
    # the recomputation (a layer's own hooks run outside it, once a step).
    return RealModel(model, lambda ids: model(input_ids=ids, labels=ids).loss, inputs, [layer.mlp for layer in decoder_layers])


def resnet18(image: int = 32) -> RealModel:
    """torchvision's ResNet-18 (10 classes, batch norm in training mode) on a batch of
    2 RGB images of ``image`` x ``image``."""
    torchvision = import_torchvision()
    assert torchvision is not None, "torchvision is not installed: the README's test command installs it"
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    model.train()

    def inputs(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(2, 3, image, image, generator=torch.Generator().manual_seed(i))
        return x, torch.tensor([i % 10, (i + 3) % 10])

    def loss(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x), labels)

    return RealModel(model, loss, inputs, [model.layer1, model.layer2, model.layer3, model.layer4])
