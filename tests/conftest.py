import torch

# Tiny models: intra-op threads only add synchronisation on a 2-core CI machine.
torch.set_num_threads(1)
