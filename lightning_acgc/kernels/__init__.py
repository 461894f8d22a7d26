"""Codec kernels, one package per family (``quant``, ``mask``, ``bounded``,
``division``): ``reference.py`` (pure torch, the specification), ``triton.py`` (CUDA),
``cpu.py`` (compiled CPU path, where one exists), the router in the package's
``__init__``; helpers shared by families in ``common/``. Imports run one way: router ->
fast paths -> reference/common."""
