"""The trainer's compute engine: Tinker losses, AdamW and LoRA adapters on a frozen base model.

`engine.TrainerEngine` is the one entry point the trainer worker calls; `losses`,
`optimizer`, `adapters` and `batching` are its parts, each usable and tested on its own.
"""
