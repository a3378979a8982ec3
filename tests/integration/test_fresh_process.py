"""compat.py in a fresh interpreter: what a process sees before anything patches it."""
import subprocess
import sys

from conftest import REPO


def test_torch_linear_is_the_functional_linear_of_a_fresh_process():
    """What `use_torch_linear` and `functional_linear_is_torchs` put back is torch's own `F.linear`."""
    code = ("import torch, torch.nn.functional as F; import compat; "
            "print(compat.torch_linear() is F.linear)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
