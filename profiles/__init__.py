"""Device profiles (``devices/``) and run configs (``runs/``): the YAML files in this folder.

Edit them here in a checkout. This file only makes the folder a package: the wheel ships it
as ``sfl_profiles`` (see pyproject.toml), so an installed copy has the profiles without the
repository; ``SFL_PROFILES_DIR`` points the commands at a folder of your own instead.
"""
