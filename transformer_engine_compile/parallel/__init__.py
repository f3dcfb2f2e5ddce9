"""Data parallelism over the layers: FSDP2 with quantized weight all-gather
(``fsdp.py``, the weight wrapper in ``fsdp_weight.py``) and 2-D tensor
parallel x FSDP2 (``fsdp_tp.py``).  Tensor and sequence parallelism run
inside the layers' ops (``distributed.py`` at the package root)."""
