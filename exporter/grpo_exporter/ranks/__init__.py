"""The rank merge: the stage layout every rank agrees on, one merge implementation per catalogue merge kind, and
the collectives (``distributed``, the only module that calls them)."""
