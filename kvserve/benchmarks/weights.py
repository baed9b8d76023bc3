"""What weights a benchmark ran, named beside its numbers (`kvserve bench` prints it and writes
it to the JSON as "weights"): a GGUF file's quantization as llama.cpp names it, with its
tensor types, else the checkpoint's dtype or --quantization."""
from __future__ import annotations

import os
from collections import Counter
from typing import Any, Optional


def matrix_types(meta: Any) -> Counter:
    """A GGUF file's matrices (its GGUFMetadata's tensors, 1-D norms left out) by type."""
    return Counter(t.type_name for t in meta.tensors if len(t.shape) >= 2)


def gguf_quantization(path: str) -> str:
    """"Q4_K_M GGUF (96 Q4_K, 17 Q6_K, 13 Q5_0)": llama.cpp's file type (general.file_type),
    else the most common matrix type, then the matrices' types by count."""
    import gguf

    from kvserve.model.gguf import read_gguf_metadata

    meta = read_gguf_metadata(path)
    counts = matrix_types(meta)
    name = counts.most_common(1)[0][0] if counts else "F32"
    try:
        name = gguf.LlamaFileType(int(meta.fields["general.file_type"])).name
        name = name.replace("MOSTLY_", "").replace("ALL_", "")
    except (KeyError, TypeError, ValueError):
        pass                    # no file type (or one this gguf does not know): the count's
    return f"{name} GGUF ({', '.join(f'{n} {t}' for t, n in counts.most_common())})"


def weights_label(model_config: Any) -> str:
    """The weights of an engine's ModelConfig, e.g. "Q4_K_M GGUF (...), packed, bfloat16
    activations", "fp8 (bfloat16 activations)" or "bfloat16"."""
    dtype = str(model_config.dtype).replace("torch.", "")
    quantization = model_config.quantization
    if quantization in ("gguf", "gguf-dequantized"):
        how = "packed" if quantization == "gguf" else "dequantized at load"
        return f"{gguf_quantization(model_config.model)}, {how}, {dtype} activations"
    if quantization:
        return f"{quantization} ({dtype} activations)"
    return dtype


def served_weights_label(model: Optional[str]) -> Optional[str]:
    """For `bench serve`, which sees the server's model path (its /v1/models root) or name
    only: the GGUF file's quantization where that is a .gguf file on this machine, else None
    (nothing is fetched: the server resolved "demo" to its file already)."""
    if model and model.endswith(".gguf") and os.path.isfile(model):
        return gguf_quantization(model)
    return None
