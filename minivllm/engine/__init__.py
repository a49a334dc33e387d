"""The engine: request processing, the engine core, its clients and process, detokenized output."""
