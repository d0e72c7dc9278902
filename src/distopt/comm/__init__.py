"""Collectives: stateless wrappers over torch.distributed, and their implementations on gloo."""
