"""The tensor-parallel S-worker (`--tensor-parallel-size T`): ranks 0..T-1 of the job hold 1/T of
every layer each (model/shard.py) and run the same steps together. Rank 0 leads: it alone reads
the input, schedules, places, samples and writes; each step it tells the others what to run
(steps.py, leader.py), and they follow (follower.py). Tensors pass between them over
torch.distributed (group.py); the checks of T against the model and the machine are checks.py.
"""
