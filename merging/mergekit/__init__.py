"""mergekit's recipes in this project: its YAML read into a `merging.recipe.Recipe`
(`reader`), its methods and parameters translated into `merging`'s (`methods`), and the
comparison of the two tools' outputs on the same recipes (`parity`).

mergekit is not a dependency: its YAML is read here, and its command is run only where a
comparison is asked for and the command is given.
"""
