"""Merging methods: each a pure function over task vectors, in a file named after it.

`REGISTRY` maps a method's config name to its `merge` function.
"""

from merging import task_arithmetic

REGISTRY = {'task_arithmetic': task_arithmetic.merge}
