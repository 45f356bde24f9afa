"""The training step: one optimizer step from one step's microbatches, one module per strategy.

`MicrobatchStep` runs the microbatches one after another (gradient accumulation); `PipelineStep`
hands them to a pipeline schedule. Both keep the loss, the gradient norm and the token weight on the
device and make one host sync per step (the non-finite check), so the loop decides when to read them.
"""
