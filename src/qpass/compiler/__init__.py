"""The compiler room: recipe -> pipeline -> pass manager -> passes, with the graph properties
passes declare and the verifier the manager runs.

* :mod:`qpass.compiler.recipe`: the YAML recipe schema and loader (``file:line`` errors).
* :mod:`qpass.compiler.pipeline`: load a model, capture both graphs once, build a recipe.
* :mod:`qpass.compiler.manager`: the pass base class, its registry and the pass manager (the
  pass lifecycle: contracts, cleanup, mutation mode, frozen results, history on ``gm.meta``).
* :mod:`qpass.compiler.properties`: the graph properties of ``requires`` / ``ensures``.
* :mod:`qpass.compiler.verify`: the graph verifier (rules as data).
* :mod:`qpass.compiler.passes`: one module per recipe word (``passes/<word>.py``).

Submodules are imported on use; importing this package imports nothing else.
"""
