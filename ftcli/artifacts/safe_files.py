"""The run dir's safe file writers, where the artifacts code has always imported them from. They live in
ftcli.config.safe_files (the lowest room) so that the pack cache (ftcli.data.cache) uses the same checks."""

from ftcli.config.safe_files import (check_output_path, entries, open_append, open_lock, open_output, refuse_links,
                                     refuse_unsafe, remove_tree, replace_dir, write_atomic, write_new, write_output)

__all__ = ["check_output_path", "entries", "open_append", "open_lock", "open_output", "refuse_links",
           "refuse_unsafe", "remove_tree", "replace_dir", "write_atomic", "write_new", "write_output"]
