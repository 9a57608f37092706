"""What the GPU machine has, printed first by bench/gpu_kit/run.sh: versions and where each
package was imported from (the image or the carried wheels), whether ftjob's trainer and the
bench import, and probes of what docs/gpu.md lists as open on torch 2.11.

    python -m bench.gpu_kit.env [--out DIR]   # DIR/results.jsonl gets the "env" result
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import inspect
import json
import platform
import sys
import traceback
from pathlib import Path

# The image's packages the trainer relies on, then the carried ones (bench/gpu_kit/wheels.txt).
IMAGE = ["torch", "triton", "accelerate", "safetensors", "tokenizers", "huggingface-hub",
         "pyarrow", "numpy", "pandas", "xxhash", "pyyaml", "regex", "typer", "psutil",
         "pytest", "pytest-timeout"]  # fmt: skip
IMPORTS = ["ftjob.trainer.train", "ftjob.cli.commands", "bench.gpu", "trl", "datasets", "peft",
           "torchao.quantization", "cel", "jsonschema"]  # fmt: skip


def carried() -> list[str]:
    wheels = Path(__file__).with_name("wheels.txt").read_text().splitlines()
    return [w.split("==")[0].strip() for w in wheels if w.split("#")[0].strip()]


def versions() -> None:
    for name in [*IMAGE, *carried(), "flash-attn", "kernels", "liger-kernel"]:
        try:
            dist = md.distribution(name)
            where = str(dist.locate_file(""))
            print(f"  {name:28} {dist.version:14} {where}")
        except md.PackageNotFoundError:
            print(f"  {name:28} -")


def torch_and_device() -> None:
    import torch

    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
          f"{torch.backends.cudnn.version()}, git {torch.version.git_version[:12]}")  # fmt: skip
    if not torch.cuda.is_available():
        print("CUDA: not available")
        return
    print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name!r}, capability {p.major}.{p.minor}, {p.multi_processor_count} "
              f"SMs, {p.total_memory / 2**30:.1f} GiB")  # fmt: skip
    b = torch.backends.cuda
    print(f"sdpa backends: flash {b.flash_sdp_enabled()}, mem_efficient "
          f"{b.mem_efficient_sdp_enabled()}, cudnn {b.cudnn_sdp_enabled()}")  # fmt: skip
    from ftjob.api.hardware import gpu_for_device_name

    gpu = gpu_for_device_name(torch.cuda.get_device_name(0))
    print(f"ftjob.api.hardware entry for this device: {gpu.name if gpu else None}")


def imports() -> None:
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
            print(f"  import {name}: ok ({getattr(module, '__file__', '?')})")
        except Exception as e:  # noqa: BLE001 - each failure is the finding
            print(f"  import {name}: FAILED {type(e).__name__}: {e}")


def varlen_gqa() -> None:
    """torch 2.11's varlen_attn has no enable_gqa: do K/V with fewer heads than Q pass through
    to the flash kernel anyway (forward and backward), equal to per-document SDPA?"""
    import torch
    from torch.nn.attention import varlen

    params = list(inspect.signature(varlen.varlen_attn).parameters)
    print(f"  varlen_attn parameters: {params}")
    torch.manual_seed(0)
    lengths, heads, kv_heads, dim = [100, 28, 128], 8, 2, 64
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    extra = {"enable_gqa": True} if "enable_gqa" in params else {}
    try:
        out = varlen.varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths),
                                 window_size=(-1, 0), **extra)  # fmt: skip
        out.float().sum().backward()
    except Exception as e:  # noqa: BLE001 - the finding
        print(f"  varlen_attn with {heads} Q / {kv_heads} KV heads {extra}: FAILED "
              f"{type(e).__name__}: {str(e)[:300]}")  # fmt: skip
        return
    refs, start = [], 0
    for n in lengths:
        part = [t[start : start + n].transpose(0, 1)[None] for t in (q, k, v)]
        refs.append(torch.nn.functional.scaled_dot_product_attention(
            *part, is_causal=True, enable_gqa=True)[0].transpose(0, 1))  # fmt: skip
        start += n
    err = (out - torch.cat(refs)).abs().max().item()
    print(
        f"  varlen_attn with {heads} Q / {kv_heads} KV heads {extra}: forward and backward "
        f"ran; max |difference| to per-document SDPA {err:.2e}; dK shape {tuple(k.grad.shape)}"
    )


def kernels() -> dict[str, str]:
    """Which attention kernels run here, forward and backward, in bf16: each SDPA backend
    alone, torch's varlen flash kernel, and flex_attention compiled (CUDA only)."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": "not available: the kernel probes need a GPU"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = {}

    def attempt(name, fn):
        try:
            q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip
            fn(q, k, v).float().sum().backward()
            torch.cuda.synchronize()
            found[name] = "ok"
        except Exception as e:  # noqa: BLE001 - each failure is the finding
            found[name] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
        print(f"  {name}: {found[name]}")

    sdpa = torch.nn.functional.scaled_dot_product_attention
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):

        def one(q, k, v, backend=backend):
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return sdpa(q, k, v, is_causal=True)

        attempt(f"sdpa {backend.lower()}", one)

    def varlen_fn(q, k, v):
        from torch.nn.attention import varlen

        cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
        flat = [t[0].transpose(0, 1).reshape(256, 8, 64) for t in (q, k, v)]
        return varlen.varlen_attn(*flat, cu, cu, 156, 156, window_size=(-1, 0))

    attempt("varlen_attn", varlen_fn)

    def flex_fn(q, k, v):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, device="cuda")
        return torch.compile(flex_attention)(q, k, v, block_mask=mask)

    attempt("flex_attention (compiled)", flex_fn)
    return found


def result(out: Path) -> None:
    """The environment as a line of out/results.jsonl, then the kernel probes' line."""
    import torch

    fields = {
        "step": "env",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    if torch.cuda.is_available():
        fields["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for name in ("transformers", "trl", "peft", "accelerate", "torchao", "triton"):
        try:
            fields[name] = md.version(name)
        except md.PackageNotFoundError:
            fields[name] = None
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(fields) + "\n")  # now: a probe below may hang or crash
    print("attention kernels (bf16, forward and backward):")
    found = kernels()
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps({"step": "kernels", **found}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        try:
            result(a.out)
        except Exception:  # noqa: BLE001 - the versions below still print
            traceback.print_exc()
    torch_and_device()
    print("packages (version, where from):")
    versions()
    print("imports:")
    imports()
    try:
        import torch

        if torch.cuda.is_available():
            print("probes:")
            varlen_gqa()
    except Exception:  # noqa: BLE001 - a probe must not hide the rest
        traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
