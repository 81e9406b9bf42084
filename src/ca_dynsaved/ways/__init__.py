"""The ways a custom-function node runs, one module each, each holding what it emits
into the CA graph at capture and what it binds or chooses each run.

``compiler.py`` hands a node to its way as ``decision.py`` decided, with the
capture's state (``state.Capture``); what a way needs at run time it leaves in that
state, which ``end_capture`` turns into the runtime's ``RunSpec``:

* ``traced``: a C++ node's ATen ops in the graph (``CppTrace``; ``SentinelTrace``
  through ``sentinel_traced``, each new tuple of its numbers checked by ``verify``);
* ``python_traced``: a Python node stock traces, its ctx numbers dynamic;
* ``opaque_op``: one op runs the backward with this step's values;
* ``tiered``: a node held both ways, the runtime choosing between two graphs;
* ``checkpointed``: checkpoint unpacks as ops in the graph.

A stock node is CA's own hook, unchanged.
"""
