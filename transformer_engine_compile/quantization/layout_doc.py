"""Markdown table of every storage's inner buffers, read from the classes'
``_BUFFERS`` declarations (docs/formats.md embeds it; a test keeps it true).

Run ``python -m transformer_engine_compile.quantization.layout_doc``.
"""

from __future__ import annotations

from . import (Float8BlockwiseQTensorStorage, Float8TensorStorage, MXFP8TensorStorage,
               NVFP4TensorStorage)

STORAGES = (Float8TensorStorage, MXFP8TensorStorage, Float8BlockwiseQTensorStorage,
            NVFP4TensorStorage)


def buffer_table() -> str:
    lines = ["| storage | flatten name | usage | contents |", "| --- | --- | --- | --- |"]
    for cls in STORAGES:
        for spec in cls._BUFFERS:
            lines.append(f"| `{cls.__name__}` | `_{spec.name}` | {spec.usage} | {spec.doc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(buffer_table())
