"""kvgroups_tools: the ``kvgroups`` command line, the demo, the model catalogue and the
transfer benchmarks.

Tooling built on the library, never part of it: ``kvgroups_core`` does not import this package.
The bench kits in ``bench_kits`` drive one runtime each and may import their framework.
"""
