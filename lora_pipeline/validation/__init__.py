"""The validate stage's checks of every params section, before any stage removes its outputs."""
