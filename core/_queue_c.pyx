# placeholder replaced by the C twin
