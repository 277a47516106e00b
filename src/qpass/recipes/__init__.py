"""Built-in recipes (YAML files; import name qpass.recipes)."""
