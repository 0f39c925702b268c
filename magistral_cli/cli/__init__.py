"""The command line: one thin module per subcommand (parse -> call core -> render)."""
