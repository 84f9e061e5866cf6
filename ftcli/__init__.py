"""ftcli: fine-tune LLMs from named recipes, all the way to a registered model."""

__version__ = "0.1.0"
