"""What crosses process boundaries, defined once; every process imports this layer and never another process.

- `run_dir`: every path of a run directory (the processes find each other's outputs only there).
- `batches`: orchestrator -> trainer, one safetensors file per trainer step.
- `weights`: trainer -> inference, one STABLE-marked HF directory per policy version.
- `packing`: token sequences -> fixed-length rows (the orchestrator packs RL batches, SFT packs demonstrations).

Files only, safetensors and JSON, never pickles; every file or directory appears atomically (`atomic`).
Policy version v = the weights after v trainer steps; version 0 is the start.
"""
