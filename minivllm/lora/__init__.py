"""LoRA adapters served beside the base model, per request (vLLM's LoRARequest)."""
