"""Test doubles, kept apart from production code: nothing in server/ or models/ imports
them. They are used by tests and the negative controls, to make a failure possible where the
real backend would never show one:

- shape_variant.py: a CPU backend whose ops change reduction order with the row count, the
  way GPU backends do, so a batch-invariance test can fail on CPU;
- faulty_kernels.py: MLX's quantized matmul with a known tiled-path fault, so the audit has
  something to catch;
- stack_reporting_checker.py: the grammar checker's child, unchanged but for its check, which
  reports the stack of the thread a grammar compiles on.
"""
