import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# Triton kernels are decorated at import: on a machine without CUDA, run them in Triton's CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs two pytest workers on two cores: one intra-op thread each avoids oversubscription on tiny ops.
torch.set_num_threads(1)
