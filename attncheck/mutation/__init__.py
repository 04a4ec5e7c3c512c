"""Mutation testing: plant one known bug in a copy of the project and see the gate fail.

``mutant`` holds what a mutant is, ``catalogue`` the known bugs, ``runner`` the runs.
"""
