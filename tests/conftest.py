import os

import torch

# Two threads, as on CI, keeps timings and results comparable between machines.
torch.set_num_threads(min(2, os.cpu_count() or 1))
