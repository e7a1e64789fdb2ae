"""User-facing benchmarks behind ``tqattn bench`` (kernel and lab scripts live in bench/).

- ``throughput``: offline generation over one workload for several kv-cache dtypes with
  identical engine arguments; JSON + markdown + a step-time plot.
"""
