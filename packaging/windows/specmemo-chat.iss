; Inno Setup 6 script: SpecMemo Chat installer for Windows (not run on the Linux build machine).
;
;   pyinstaller --noconfirm --distpath build\dist --workpath build\pyi packaging\specmemo-chat.spec
;   iscc /DAppVersion=0.1.0 packaging\windows\specmemo-chat.iss
;
; Installs the one-folder bundle build\dist\specmemo-chat into Program Files (or the
; user's programs folder without admin rights). User data (%LOCALAPPDATA%\specmemo\specmemo:
; chats, downloaded models, settings) is outside the install folder and is kept on
; uninstall unless the user says yes to removing it.

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif
#define AppName "SpecMemo Chat"
#define AppExe "specmemo-chat.exe"
#define Root "..\.."

[Setup]
AppId={{7B3E2A51-5C1D-4E0B-9A7F-5EC0DE0C4A7A}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=SpecMemo Chat
DefaultDirName={autopf}\SpecMemo Chat
DefaultGroupName={#AppName}
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir={#Root}\build\installer
OutputBaseFilename=SpecMemoChat-{#AppVersion}-setup
SetupIconFile={#Root}\assets\icons\specmemo-chat.ico
UninstallDisplayIcon={app}\{#AppExe}
Compression=lzma2/max
SolidCompression=yes
DiskSpanning=no
WizardStyle=modern

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"

[Files]
Source: "{#Root}\build\dist\specmemo-chat\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\{#AppName}"; Filename: "{app}\{#AppExe}"
Name: "{group}\{cm:UninstallProgram,{#AppName}}"; Filename: "{uninstallexe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

[Code]
procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  DataDir: String;
begin
  { platformdirs.user_data_path("specmemo") is {localappdata}\specmemo\specmemo }
  DataDir := ExpandConstant('{localappdata}\specmemo');
  if (CurUninstallStep = usPostUninstall) and DirExists(DataDir) and not UninstallSilent then
    if MsgBox('Also delete your chats, downloaded models and settings in ' + DataDir + '?',
              mbConfirmation, MB_YESNO or MB_DEFBUTTON2) = IDYES then
      DelTree(DataDir, True, True, True);
end;
