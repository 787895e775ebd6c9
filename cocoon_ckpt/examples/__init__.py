"""Built-in example jobs (`example:mlp`, `example:dlrm`): builders that take a JobConfig
and return JobParts, as a user's `module:function` does."""
