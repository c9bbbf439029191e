"""Model zoo: self-contained, fx-traceable builders that default to the meta device."""
