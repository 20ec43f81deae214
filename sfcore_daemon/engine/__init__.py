"""The decode thread: jobs, slots and sequences, the batched step loop, sampling, speculation,
and the step's side of the prompt store. Nothing on that thread logs or does file I/O."""
