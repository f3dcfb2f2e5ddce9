"""Compile machinery: torch-version compat, value-opaque registration,
TensorProto.  Import the submodules directly (``dynamo.opaque``,
``dynamo.tensor_proto``); this package imports nothing so that the
quantization modules can use ``dynamo.opaque`` without an import cycle."""
