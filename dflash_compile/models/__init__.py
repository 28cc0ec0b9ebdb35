"""The drafter (a few Qwen3 layers reading the target's hidden states), its DFlash config and the three checkpoint
formats it reads and writes. Imports nothing from the runtime."""
