"""The decode thread: jobs, slots and sequences, the batched step loop, sampling,
speculation, and the step's side of the prompt store. Nothing here logs or does I/O."""
