"""hardeq.diffusion without diffusers installed: the native samplers work, ConstrainedScheduler names the extra.
(In its own module: the scheduler's tests skip where diffusers is missing, this one must run there.)"""

import subprocess
import sys


def test_import_without_diffusers():
    """import hardeq.diffusion (and the native samplers) work in a fresh interpreter where diffusers is missing."""
    code = (
        "import sys; sys.modules['diffusers'] = None\n"
        "import torch, hardeq.diffusion as hd\n"
        "c = hd.channel_sum_constraint((2, 1, 2, 2), [1.0])\n"
        "x = hd.ddim_sample(lambda x, t: 0 * x, (2, 1, 2, 2), hd.DDIMOptions(num_steps=2, num_train_timesteps=4), "
        "constraint=c)\n"
        "assert hd.satisfies_constraint(x, c).all() and 'diffusers' not in {m.split('.')[0] for m in sys.modules "
        "if sys.modules[m] is not None}\n"
        "try:\n    hd.ConstrainedScheduler(None)\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'pip install "hardeq[diffusion]"' in out.stdout
