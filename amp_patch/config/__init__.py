"""What the user configures, as data: opt levels and op lists (loading, validation). No patching here."""
