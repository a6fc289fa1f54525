def main() -> None:
    print("eyas")
