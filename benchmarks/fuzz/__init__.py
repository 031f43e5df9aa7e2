"""A differential random-program fuzzer for Terra: ``python -m benchmarks.fuzz``.

It generates random imperative TF2 training programs as Python source (in the spirit of Csmith,
"Finding and Understanding Bugs in C Compilers": random programs, differential testing, then
reduction), runs each eagerly and under Terra in separate processes and compares every step's
loss and the final variables. See docs/fuzz.md.

Modules: ``models`` (the base of a program), ``snippets`` (the feature template machinery),
``control`` and ``state`` (the features), ``program`` (drawing and rendering), ``standalone``
(the harness each generated file carries), ``runner`` (one program, two processes),
``minimize`` and ``driver`` (the campaign).
"""
