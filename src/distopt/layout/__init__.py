"""Pure layout arithmetic: where each parameter lies in the flat buffers, which bucket holds it
and which rank owns each element. No ``torch.distributed`` here: every rank computes the same
layout from the same inputs, and tests check it without processes.

- ``elementwise``: buckets padded to a multiple of d, shards that ignore param boundaries.
- ``whole``: buckets in which each param of a whole-tensor optimizer lies in one rank's shard.
- ``planner``: the one entry point the DDP and every prediction call.
"""
