"""Folders and zip archives of checkpoint files that no other plug-in names: each file a part."""
