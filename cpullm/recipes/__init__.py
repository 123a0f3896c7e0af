"""Recipes: a model plus a hardware class, planned into vLLM's ``config.yml`` + ``env.sh``."""

from cpullm.recipes.hardware import Hardware, hardware_classes, resolve_hardware
from cpullm.recipes.recipe import ModelFacts, Recipe, make_recipe, model_facts

__all__ = ["Hardware", "ModelFacts", "Recipe", "hardware_classes", "make_recipe",
           "model_facts", "resolve_hardware"]
