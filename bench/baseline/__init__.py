"""The baseline users would pick instead of Phalanx: torchrun (torch.distributed.elastic) restarts
with plain DDP and torch.distributed.checkpoint, measured on the same model and data."""
