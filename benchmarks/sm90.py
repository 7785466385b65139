"""Compile a Triton kernel for sm_90 on any machine (no GPU) and report what ptxas says: shared memory,
registers, stack, spills. Used by compile_mamba2_sm90.py and compile_gdn_sm90.py.

Uses the installed triton (compile with the GPU's version, e.g. a triton 3.6 wheel on PYTHONPATH) and its
bundled ptxas. A kernel whose shared memory exceeds SHARED_LIMIT fails to launch on an H100/H200.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHARED_LIMIT = 232448


def aligned(fn, signature: dict, ints: dict) -> dict:
    """The JIT's specialisation on a launch: pointers (torch allocations) and specialised ints that are
    multiples of 16 carry tt.divisibility = 16 (without it loads are not vectorised: a pointer per element)."""
    keep = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    div16 = [n for n, ty in signature.items() if ty.startswith("*")
             or (n in ints and n not in keep and ints[n] % 16 == 0)]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}


def report(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, ints: dict | None = None) -> str:
    """One line: shared memory, then ptxas's registers / stack / spills for the compiled kernel.
    ints: the runtime integer arguments' values (for the JIT's divisibility specialisation)."""
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned(fn, signature, ints or {}))
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    info = [line.split("info    :")[-1].strip() for line in (out.stdout + out.stderr).splitlines()
            if "stack frame" in line or "Used" in line]
    over = "  OVER THE SHARED LIMIT" if kernel.metadata.shared > SHARED_LIMIT else ""
    return f"{fn.__name__:28s} warps={num_warps} shared={kernel.metadata.shared:6d}  " + "; ".join(info) + over
