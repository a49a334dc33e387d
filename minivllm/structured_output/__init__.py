"""Structured outputs: grammars compiled off the critical path, token bitmasks per step."""

# grammar.py turns StructuredOutputsParams into one grammar spec (and checks it in the
# frontend, so a bad schema is a 400); backend_xgrammar.py compiles specs and makes matchers;
# request.py is one request's state; manager.py, in the engine core, compiles in a thread,
# fills each step's bitmask while the forward pass runs, and advances matchers.
