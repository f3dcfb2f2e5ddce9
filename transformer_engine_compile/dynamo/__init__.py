"""Compile machinery: the custom-op generator and its buckets, TensorProto,
lowering into inductor, the layers' compiled state.  Import the submodules
directly (``dynamo.custom_op``, ``dynamo.tensor_proto``)."""
