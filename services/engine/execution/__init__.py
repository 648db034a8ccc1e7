"""Running a step: the model runner, per-step inputs, sampling and the tensor-parallel worker ranks."""
