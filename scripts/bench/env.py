"""Section ``env``: versions, GPU, and the measured ceilings (bf16 matmul TFLOP/s, device copy TB/s)."""

from __future__ import annotations

import json
import platform
import time
from typing import Any

import torch

from scripts.bench.common import Bench, free_gpu, timed


def run(bench: Bench) -> None:
    """Record the software versions and, on CUDA, the GPU and its measured ceilings."""
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "importable")
    except Exception as error:  # noqa: BLE001 - any import failure means "not available"
        info["fla"] = f"not importable: {error}"
    if torch.cuda.is_available():
        info.update(_ceilings())
        free_gpu()  # the ceilings' tensors are gone once _ceilings returns
    bench.results.env = info
    bench.say(f"env: {json.dumps(info)}")


def _ceilings() -> dict[str, Any]:
    """The GPU's name and size, bf16 matmul TFLOP/s (8192³, random data) and device copy TB/s (2 GiB)."""
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {"gpu": props.name, "sms": props.multi_processor_count,
                            "memory_gib": round(props.total_memory / 2**30, 1)}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _, dt = timed(lambda: [a @ b for _ in range(10)])
    info["bf16_matmul_tflops"] = round(10 * 2 * 8192**3 / dt / 1e12, 1)
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    _, dt = timed(lambda: [dst.copy_(src) for _ in range(5)])
    info["copy_tb_s"] = round(5 * 2 * src.numel() * 2 / dt / 1e12, 2)
    return info
