"""The gate: the generic tests every kernel family is verified by.

Run it in any repository with attncheck installed: ``attncheck gate`` or
``pytest --pyargs attncheck.gate`` (with ``--attncheck-impl``/``--attncheck-spec`` naming
that repository's kernels).
"""
