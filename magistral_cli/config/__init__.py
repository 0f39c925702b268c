"""Recipes: the schema, YAML loading with overrides, and module patterns."""

from .loader import apply_overrides, load_recipe, read_yaml, recipe_to_yaml, validate_recipe
from .schema import Recipe, check_world_size

__all__ = [
    "Recipe",
    "apply_overrides",
    "check_world_size",
    "load_recipe",
    "read_yaml",
    "recipe_to_yaml",
    "validate_recipe",
]
