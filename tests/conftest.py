import os

# One thread per test process (and its subprocesses): the models here are tiny, and on a
# loaded 2-core machine OpenMP's spinning threads turn seconds into minutes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
