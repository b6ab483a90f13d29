"""Packed multi-adapter LoRA training over one frozen base model."""
